"""The ``hsdata`` command line, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys

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
    result = hsdata_cli("info", str(store_path), "--json")
    summary = json.loads(result.stdout)
    assert summary["samples"] == 5 and summary["tokens"] == 150 and summary["aux_layers"] == [1, 4, 6]
    assert summary["length"]["min"] == 10 and summary["length"]["max"] == 50
    assert summary["payload_bytes"] == 150 * (4 + 1 + 2 * 32 * 4)


def test_not_a_store_is_exit_code_2_with_one_line(tmp_path):
    result = hsdata_cli("info", str(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"hsdata info: error: {tmp_path} is not an hsdata store: it has no zarr.json"]


def test_bad_usage_is_exit_code_2(tmp_path):
    assert hsdata_cli("frobnicate").returncode == 2
    result = hsdata_cli("info", str(tmp_path), "--storage-option", "novalue")
    assert result.returncode == 2 and "expects KEY=VALUE" in result.stderr
