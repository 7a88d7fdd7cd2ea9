"""`hsdata extract --engine hf`: stored states equal transformers' own, bit for bit; loss masks; resume; CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hsdata
from conftest import assert_same
from hsdata.extract import demo, engine_hf
from hsdata.extract.conversations import read_jsonl, tokenize
from hsdata.validate import validate


@pytest.fixture(scope="module")
def tokenizer():
    return demo.tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return demo.model(len(tokenizer), seed=3)


def reference(model, batch):
    """transformers' output_hidden_states for one padded batch, exactly as the engine builds it."""
    input_ids, attention = engine_hf.pad_batch(batch)
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=attention, output_hidden_states=True)
    return out.hidden_states


def assert_store_holds_transformers_states(store_path, model, tokenizer, records, max_batch_tokens=8192):
    """Every sample equals transformers' own hidden states of its batch, converted to the stored dtype."""
    store = hsdata.open(store_path)
    layers = [1, 3, 4]  # EAGLE-3's defaults for 8 layers, "output of layer k"
    assert list(store.spec.aux_layers) == layers and store.spec.layer_convention == "output_of_layer"
    assert store.spec.vocab_size == model.config.vocab_size  # so validate can check every input id
    stored = getattr(torch, store.spec.dtype)
    todo = [(r.sample_id, tokenize(tokenizer, r)[0]) for r in records]
    batches = list(engine_hf.batches_by_length(todo, max_batch_tokens))
    for batch in batches:
        hidden = reference(model, batch)
        for b, (sample_id, ids) in enumerate(batch):
            got = store.get(sample_id)
            n = len(ids)
            aux = torch.cat([hidden[k + 1][b, :n] for k in layers], dim=-1)
            assert got["input_ids"].tolist() == ids
            # transformers' last hidden_states entry is the output of the final norm
            assert_same(got, {"aux_hidden_states": aux.to(stored), "hidden_states": hidden[-1][b, :n].to(stored)})
    assert validate(store_path).ok
    return batches


@pytest.mark.parametrize("max_batch_tokens", [1, 400])
def test_stored_states_equal_transformers_hidden_states(tmp_path, model, tokenizer, max_batch_tokens):
    records = list(read_jsonl(demo.data_path()))
    store_path = str(tmp_path / "store")
    summary = engine_hf.extract(model, tokenizer, records, store_path, model_name="demo",
                                max_batch_tokens=max_batch_tokens)
    assert summary.ok and summary.written == len(records)
    batches = assert_store_holds_transformers_states(store_path, model, tokenizer, records, max_batch_tokens)
    assert (len(batches) == len(records)) == (max_batch_tokens == 1)


@pytest.mark.parametrize("dtype, store_dtype", [(torch.float32, None), (torch.float32, "bfloat16"),
                                                (torch.float32, torch.float16), (torch.float16, None)])
def test_models_of_each_dtype_store_their_states_as_computed_or_converted(tmp_path, tokenizer, dtype, store_dtype):
    model = demo.model(len(tokenizer), seed=3, dtype=dtype)
    records = list(read_jsonl(demo.data_path()))[:8]
    store_path = str(tmp_path / "store")
    summary = engine_hf.extract(model, tokenizer, records, store_path, model_name="demo", store_dtype=store_dtype,
                                max_batch_tokens=400)
    assert summary.ok and summary.written == len(records)
    spec = hsdata.open(store_path).spec
    assert (spec.dtype, spec.compute_dtype) == (str(store_dtype or dtype).removeprefix("torch."),
                                                str(dtype).removeprefix("torch."))
    assert_store_holds_transformers_states(store_path, model, tokenizer, records, max_batch_tokens=400)


def test_loss_masks_cover_assistant_turns_only(tmp_path, model, tokenizer):
    records = list(read_jsonl(demo.data_path()))
    engine_hf.extract(model, tokenizer, records, str(tmp_path / "store"), model_name="demo")
    store = hsdata.open(str(tmp_path / "store"))
    for record in records:
        got = store.get(record.sample_id)
        ids, mask = got["input_ids"].tolist(), got["loss_mask"].tolist()
        trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        expected = "".join(m["content"] + "<|end|>\n" for m in record.messages if m["role"] == "assistant")
        assert trained == expected, record.sample_id


def test_aux_layers_out_of_range(tmp_path, model, tokenizer):
    with pytest.raises(ValueError, match=r"aux_layers \[1, 2, 8\]: the model has 8 layers"):
        engine_hf.extract(model, tokenizer, [], str(tmp_path / "s"), model_name="demo", aux_layers=[1, 2, 8])


def cli(*args):
    return subprocess.run([sys.executable, "-m", "hsdata", "extract", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_embedded_default_then_resume(tmp_path):
    store = str(tmp_path / "demo-store")
    first = cli("--out", store)
    assert first.returncode == 0, first.stderr
    assert "OK: 24 samples: 0 already in the store, 24 written" in first.stdout
    second = cli("--out", store)
    assert second.returncode == 0 and "24 already in the store, 0 written" in second.stdout
    assert validate(store).ok and len(hsdata.open(store)) == 24


@pytest.mark.parametrize("store_dtype", [None, "bfloat16"])
def test_cli_float32_model_stored_as_computed_or_as_bfloat16(tmp_path, tokenizer, store_dtype):
    store = str(tmp_path / "store")
    result = cli("--out", store, "--dtype", "float32", *(["--store-dtype", store_dtype] if store_dtype else []))
    assert result.returncode == 0, result.stderr
    spec = hsdata.open(store).spec
    assert (spec.dtype, spec.compute_dtype) == (store_dtype or "float32", "float32")
    same_weights = demo.model(len(tokenizer), seed=0, dtype=torch.float32)  # the CLI's demo model
    assert_store_holds_transformers_states(store, same_weights, tokenizer, list(read_jsonl(demo.data_path())))


def test_cli_refuses_a_store_dtype_it_cannot_convert_to(tmp_path):
    result = cli("--out", str(tmp_path / "s"), "--dtype", "bfloat16", "--store-dtype", "float32")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "hsdata extract: error: cannot store bfloat16 hidden states as float32: the stored dtype must be the compute "
        "dtype, float32 stored as bfloat16 or float16, or any of them as fp8"]
    assert not (tmp_path / "s").exists()


def test_cli_model_from_a_config_with_pre_tokenized_rows(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows = [{"id": f"r{i}", "input_ids": list(range(1 + i, 20 + 3 * i)), "loss_mask": None} for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                                 for r in rows))
    result = cli("--model", str(tmp_path / "config.json"), "--data", str(tmp_path / "rows.jsonl"),
                 "--out", str(tmp_path / "s"), "--aux-layers", "0", "2", "4")
    assert result.returncode == 0, result.stderr
    store = hsdata.open(str(tmp_path / "s"))
    assert list(store.spec.aux_layers) == [0, 2, 4] and store.spec.hidden_size == 64 and len(store) == 5
    assert store.get("r2")["loss_mask"].tolist() == [1] * len(rows[2]["input_ids"])


def test_cli_bad_usage(tmp_path):
    assert cli("--model", str(tmp_path / "config.json"), "--out", str(tmp_path / "s")).returncode == 2
    assert cli("--server", "http://127.0.0.1:9", "--engine", "hf", "--out", "x").returncode == 2
