"""Several processes write one store at the same time without coordinating (and race to create it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import hsdata
from conftest import assert_same, make_sample

WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import hsdata
    from conftest import SPEC, make_sample
    while not os.path.exists({go!r}):
        time.sleep(0.001)
    with hsdata.create({store!r}, **SPEC, shard_tokens=256, chunk_tokens=16) as w:
        for i in range({count}):
            w.add(f"{name}-{{i}}", **make_sample(10 + (i * 37) % 200, seed={seed} + i))
            if i % 7 == 0:
                w.flush()
""")


def test_two_processes_create_and_write_one_store_at_once(tmp_path):
    store, go = tmp_path / "store", tmp_path / "go"
    tests = str(__import__("pathlib").Path(__file__).parent)
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER.format(tests=tests, go=str(go), store=str(store), count=40,
                                                              name=name, seed=seed)])
        for name, seed in (("alpha", 0), ("beta", 1000))
    ]
    time.sleep(1.0)  # both processes are importing and waiting
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    result = hsdata.open(str(store))
    assert len(result) == 80
    assert len(set(result.manifest.column("part").to_pylist())) == 2
    for name, seed in (("alpha", 0), ("beta", 1000)):
        for i in range(40):
            assert_same(result.get(f"{name}-{i}"), make_sample(10 + (i * 37) % 200, seed=seed + i))
