"""``hsdata show``: one sample's tensors, per-layer statistics and text, on stores with known values."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch
from transformers import AutoTokenizer

import hsdata
from hsdata import show
from hsdata.extract import demo
from hsdata.cli import main

H = 32
AUX = [1, 2, 5]


def known_sample(dtype: torch.dtype = torch.bfloat16) -> dict:
    """10 tokens: layer 1 all 1.0, layer 2 all 3.0, layer 5 all 2.0 but a NaN at token 2 and an Inf at token 4;
    the final state of token t all t. Tokens 3-5 and 8-9 are in the loss."""
    aux = torch.cat([torch.full((10, H), 1.0), torch.full((10, H), 3.0), torch.full((10, H), 2.0)], dim=1)
    aux[2, 2 * H] = math.nan
    aux[4, 2 * H + 3] = math.inf
    return {
        "input_ids": torch.arange(100, 110),
        "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1]),
        "aux_hidden_states": aux.to(dtype),
        "hidden_states": torch.arange(10.0).repeat_interleave(H).view(10, H).to(dtype),
    }


def write(path, samples: dict, dtype: str = "bfloat16", model: str | None = "test/tiny") -> str:
    with hsdata.create(str(path), hidden_size=H, aux_layers=AUX, model=model, dtype=dtype, shard_tokens=256,
                       chunk_tokens=16) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    return str(path)


def no_nan(text: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"{constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def show_json(capsys, *args: str) -> dict:
    assert main(["show", *args, "--json"]) == 0
    return no_nan(capsys.readouterr().out)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    demo.tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_statistics_of_known_values(tmp_path, capsys, dtype):
    sample = known_sample(getattr(torch, dtype))
    store = write(tmp_path / "store", {"other": sample, "s": sample}, dtype)
    report = show_json(capsys, store, "s")
    assert (report["sample_id"], report["index"], report["num_tokens"], report["token_offset"]) == ("s", 1, 10, 10)
    assert report["tensors"] == {
        "input_ids": {"shape": [10], "dtype": "int64"},
        "loss_mask": {"shape": [10], "dtype": "uint8"},
        "aux_hidden_states": {"shape": [10, 3 * H], "dtype": dtype},
        "hidden_states": {"shape": [10, H], "dtype": dtype},
    }
    one, three, two, final = report["layers"]
    assert [layer["label"] for layer in report["layers"]] == ["layer 1", "layer 2", "layer 5", "final"]
    assert one["mean_norm"] == pytest.approx(math.sqrt(H), rel=1e-4)
    assert three["mean_norm"] == pytest.approx(3 * math.sqrt(H), rel=1e-4)
    assert (three["min"], three["max"], three["nan"], three["inf"]) == (3.0, 3.0, 0, 0)
    assert three["norms"] == [pytest.approx(3 * math.sqrt(H), rel=1e-4)] * 10
    assert (two["min"], two["max"], two["nan"], two["inf"]) == (2.0, 2.0, 1, 1)
    assert two["mean_norm"] == pytest.approx(2 * math.sqrt(H), rel=1e-4)  # over the 8 finite tokens
    assert two["norms"][2] is None and two["norms"][4] is None
    assert two["sparkline"] == "▄▄!▄!▄▄▄▄▄" and three["sparkline"] == "▄" * 10
    assert (final["min"], final["max"], final["sparkline"]) == (0.0, 9.0, "▁▂▃▃▄▅▆▆▇█")
    assert final["mean_norm"] == pytest.approx(4.5 * math.sqrt(H), rel=1e-4)
    assert report["loss_mask"] == {"in_loss": 5, "spans": [[3, 6], [8, 10]]}
    assert report["input_ids"] == list(range(100, 110)) and report["text"] is None


def test_an_fp8_store_reports_the_values_its_reads_give(tmp_path, capsys):
    sample = known_sample()
    sample["aux_hidden_states"][:, :H] = torch.linspace(-3, 7, 10 * H).view(10, H)  # values fp8 must round
    sample["aux_hidden_states"] = sample["aux_hidden_states"].nan_to_num(nan=0.5, posinf=6.0)
    store = write(tmp_path / "store", {"s": sample}, "float8_e4m3fn")
    report = show_json(capsys, store, "s")
    read = hsdata.open(store)[0]
    assert report["tensors"]["aux_hidden_states"] == {"shape": [10, 3 * H], "dtype": "bfloat16"}
    for layer, states in zip(report["layers"], [*read["aux_hidden_states"].split(H, dim=1), read["hidden_states"]]):
        wide = states.double()
        norms = torch.linalg.vector_norm(wide, dim=1).tolist()
        assert layer["norms"] == [pytest.approx(v, rel=1e-4) for v in norms]
        assert (layer["min"], layer["max"]) == (float(wide.min()), float(wide.max()))


def test_text_output(tmp_path, capsys):
    store = write(tmp_path / "store", {"s": known_sample()})
    assert main(["show", store, "s"]) == 0
    out = capsys.readouterr().out
    assert "sample      s  (index 0 of 1)" in out
    assert f"aux_hidden_states bfloat16 [10, {3 * H}], hidden_states bfloat16 [10, {H}]" in out
    norm = 3 * math.sqrt(H)
    assert f"layer 2     {norm:>10.5g}          3          3      0      0  ▄▄▄▄▄▄▄▄▄▄" in out
    assert "layer 5" in out and "▄▄!▄!▄▄▄▄▄" in out
    assert "loss mask   5 of 10 tokens in the loss (mask 1), 2 span(s): [3, 6) [8, 10)" in out
    assert "100 101 102 [[103 104 105]] 106 107 [[108 109]]" in out
    assert "\x1b[" not in out


def test_sparkline_buckets_long_samples():
    line = show.sparkline([float(v) for v in range(1000)])
    assert len(line) == show.SPARK_WIDTH and line[0] == "▁" and line[-1] == "█"
    assert show.sparkline([1.0, math.nan, 3.0]) == "▁!█"
    assert show.sparkline([1.0] * 120 + [math.inf]) == "▄" * 59 + "!"


def test_sample_id_first_then_index(tmp_path, capsys):
    store = write(tmp_path / "store", {"1": known_sample(), "x": known_sample(), "y": known_sample()})
    assert show_json(capsys, store, "1")["index"] == 0  # the id "1", not index 1
    assert show_json(capsys, store, "2")["sample_id"] == "y"
    assert show_json(capsys, store, "-2")["sample_id"] == "x"


@pytest.mark.parametrize("key", ["nope", "3", "-4"])
def test_unknown_sample_is_one_line_exit_2(tmp_path, capsys, key):
    store = write(tmp_path / "store", {"a": known_sample(), "b": known_sample(), "c": known_sample()})
    assert main(["show", store, key]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"hsdata show: error: no sample {key} in {store} (3 samples; ids like a, b, c)"]


def test_not_a_store_is_exit_2(tmp_path, capsys):
    assert main(["show", str(tmp_path), "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hsdata show: error: {tmp_path} is not an hsdata store: it has no zarr.json"]


def test_sample_without_loss_mask(tmp_path, capsys):
    store = write(tmp_path / "store", {"s": {**known_sample(), "loss_mask": None}})
    report = show_json(capsys, store, "0")
    assert report["loss_mask"] is None and report["tensors"]["loss_mask"] is None
    assert main(["show", store, "0"]) == 0
    out = capsys.readouterr().out
    assert "loss mask   none" in out and "100 101 102 103 104 105 106 107 108 109" in out and "[[" not in out


def conversation(tokenizer_dir: str) -> dict:
    """A user turn then an assistant turn (in the loss), tokenized by the saved demo tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    prompt = tokenizer.encode("<|user|>\nHello there<|end|>\n")
    answer = tokenizer.encode("<|assistant|>\nHi, how are you?<|end|>\n")
    n = len(prompt) + len(answer)
    states = torch.ones(n, 3 * H, dtype=torch.bfloat16)
    mask = [0] * len(prompt) + [1] * len(answer)
    return {"input_ids": torch.tensor(prompt + answer), "loss_mask": torch.tensor(mask),
            "aux_hidden_states": states, "hidden_states": states[:, :H]}


def test_decoded_text_marks_the_loss_spans(tmp_path, capsys, tokenizer_dir):
    store = write(tmp_path / "store", {"chat": conversation(tokenizer_dir)})
    marked = "<|user|>\nHello there<|end|>\n[[<|assistant|>\nHi, how are you?<|end|>\n]]"
    assert main(["show", store, "chat", "--tokenizer", tokenizer_dir]) == 0
    out = capsys.readouterr().out
    assert f"text        (tokenizer {tokenizer_dir}; tokens in the loss between [[ ]])\n{marked}" in out
    report = show_json(capsys, store, "chat", "--tokenizer", tokenizer_dir)
    assert "".join(s["text"] for s in report["text"]) == marked.replace("[[", "").replace("]]", "")
    assert [s["in_loss"] for s in report["text"]] == [False, True]
    colored = show.render(report, color=True)
    assert f"{show.ANSI_LOSS}<|assistant|>" in colored and "[[" not in colored


def test_tokenizer_recorded_as_the_model(tmp_path, capsys, tokenizer_dir):
    store = write(tmp_path / "store", {"chat": conversation(tokenizer_dir)}, model=tokenizer_dir)
    report = show_json(capsys, store, "chat")
    assert report["tokenizer"] == tokenizer_dir and report["text"][1]["text"].startswith("<|assistant|>")


def test_bad_tokenizer_is_exit_2(tmp_path, capsys):
    store = write(tmp_path / "store", {"s": known_sample()})
    assert main(["show", store, "s", "--tokenizer", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"hsdata show: error: no tokenizer can be loaded from {tmp_path / 'missing'} (local files only)"]


def test_plot_without_matplotlib_names_the_install(tmp_path, capsys, monkeypatch):
    store = write(tmp_path / "store", {"s": known_sample()})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["show", store, "s", "--plot", str(tmp_path / "norms.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "norms.png").exists()
    assert len(captured.err.splitlines()) == 1 and "pip install matplotlib" in captured.err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_a_png(tmp_path, capsys):
    store = write(tmp_path / "store", {"s": known_sample()})
    png = tmp_path / "norms.png"
    assert show_json(capsys, store, "s", "--plot", str(png))["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
