"""The ``hsdata`` command line, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import make_sample, write_store


def hsdata_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdata", *args], capture_output=True, text=True, timeout=120)


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
