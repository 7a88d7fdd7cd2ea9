"""``python -m benchmarks``: the suite's RESULTS.md block is replaced in place, one benchmark's section at a time,
and what it was not asked to run stays. (The benchmarks themselves are measured, not tested, here.)"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
suite = runpy.run_path(os.path.join(ROOT, "benchmarks", "__main__.py"), run_name="benchmark_suite")
FACTS = {"commit": "abc1234", "cpus": 2, "memory_gib": 24, "gpu": None, "python": "3.11", "torch": "2.14",
         "zarr": "3.1", "platform": "Linux"}


def test_results_block_is_replaced_per_benchmark_and_keeps_the_rest():
    update, header = suite["update_results"], suite["suite_header"]("small", FACTS)
    text = "# Benchmark results\n\nThe write-up.\n\n## A hand-written section\nfigures\n"
    first = update(text, {"read": "read v1", "write": "write v1"}, header)
    assert first.startswith(text.rstrip())
    assert update(first, {"read": "read v1", "write": "write v1"}, header) == first  # a rerun changes nothing

    again = update(first, {"read": "read v2"}, header)  # like --only read
    assert "read v2" in again and "read v1" not in again
    assert "write v1" in again  # write's section from the earlier run stays
    assert again.index("write v1") < again.index("read v2")  # sections in suite order (write, then read)
    assert again.count(suite["BEGIN"]) == 1 and again.count(suite["END"]) == 1
    assert again.startswith(text.rstrip()) and "## A hand-written section\nfigures" in again


def test_sections_show_the_command_and_a_table_or_why_not():
    ok = {"name": "migrate", "what": "import and export", "command": "python benchmarks/migrate_bench.py --samples 16",
          "size": "small", "status": "ok", "seconds": 3.0, "machine": "2 CPUs, 24 GiB, GPU none",
          "result": {"format": "specforge", "import_mib_s": 114.4, "nested": {"skipped": 1}}}
    text = suite["section"](ok)
    assert "python benchmarks/migrate_bench.py --samples 16" in text
    assert "| format | import_mib_s |" in text and "| specforge | 114 |" in text and "nested" not in text
    skipped = {**ok, "name": "capture", "status": "skipped: needs a CUDA GPU, none here"}
    del skipped["result"]
    assert "**skipped: needs a CUDA GPU, none here**" in suite["section"](skipped)


def test_unknown_benchmark_is_named():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "reed"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert "unknown benchmark(s) reed" in done.stderr and "read" in done.stderr


@pytest.mark.parametrize("bench", suite["SUITE"], ids=lambda b: b.name)
def test_every_benchmark_accepts_its_suite_arguments(bench):
    """Each script's parser takes the arguments the suite passes at both sizes (and --json)."""
    script = os.path.join(ROOT, "benchmarks", bench.script)
    assert os.path.exists(script)
    source = open(script).read()
    for size in ("small", "large"):
        for flag in [a for a in suite["command_line"](bench, size, "/tmp/x") if a.startswith("--")] + ["--json"]:
            assert f'"{flag}"' in source, f"{bench.script} has no {flag} option (size {size})"


def test_a_rendering_error_leaves_results_as_they_were(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nThe write-up.\n")
    monkeypatch.setitem(suite["write_results"].__globals__, "RESULTS", str(results))
    broken = {"name": "read", "what": "reads", "command": "python benchmarks/read_bench.py", "size": "small",
              "status": "ok", "seconds": 1.0, "result": {"results": [{"x": 1}]}}  # no "machine": section() fails
    with pytest.raises(KeyError):
        suite["write_results"]([broken], "## header")
    assert results.read_text() == "# Benchmark results\n\nThe write-up.\n"
    suite["write_results"]([{**broken, "machine": "2 CPUs"}], "## header")
    assert results.read_text().startswith("# Benchmark results\n\nThe write-up.\n") and "| x |" in results.read_text()
