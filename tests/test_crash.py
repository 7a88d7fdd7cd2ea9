"""Crash safety with real processes and real files: kill -9 at random moments, a filesystem that fills up."""

from __future__ import annotations

import os
import random
import signal
import shutil
import subprocess
import sys
import time

import pytest

import hsdata
from conftest import SPEC, assert_same, make_sample
from hsdata.validate import validate

LAYOUT = dict(shard_tokens=256, chunk_tokens=16)
KILLS_PER_STORE = 8


def length_of(i: int) -> int:
    return 1 + (i * 7919) % 300


FORKING_WRITERS = """
import os, sys, time
sys.path.insert(0, {tests!r})
import hsdata
from conftest import SPEC, make_sample
from test_crash import LAYOUT, length_of

def write(store):
    with hsdata.create(store, **SPEC, **LAYOUT) as w:
        print("ready", os.getpid(), flush=True)
        for i in range(100_000):
            if f"s{{i}}" in w:
                continue
            w.add(f"s{{i}}", **make_sample(length_of(i), seed=i))
            if i % 13 == 0:
                w.flush()
            time.sleep(0.002)  # a producer (the model) takes time between samples

print("ready", flush=True)
for line in sys.stdin:  # one writer process per line (a store's path), forked from this one
    pid = os.fork()
    if pid == 0:
        try:
            write(line.strip())
        finally:
            os._exit(1)
    print("ended", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.fixture
def kill_a_writer():
    """``kill(store, seconds)``: a writer process into ``store``, SIGKILLed ``seconds`` after it opened the store.

    Writers are forked from one process that imported hsdata once (a fresh interpreter takes 1.5-2 s to start)."""
    script = FORKING_WRITERS.format(tests=os.path.dirname(__file__))
    forker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert forker.stdout.readline() == "ready\n"

    def kill(store, seconds: float) -> None:
        forker.stdin.write(f"{store}\n")
        forker.stdin.flush()
        ready, pid = forker.stdout.readline().split()
        assert ready == "ready"
        time.sleep(seconds)
        os.kill(int(pid), signal.SIGKILL)
        assert forker.stdout.readline().split() == ["ended", str(-signal.SIGKILL)]

    yield kill
    forker.stdin.close()
    assert forker.wait(timeout=30) == 0


@pytest.mark.parametrize("seed", range(3))  # 3 stores of 8 kills: every kill checked in full, the store kept small
def test_kill_9_at_random_moments_loses_nothing_committed(tmp_path, kill_a_writer, seed):
    store = tmp_path / "store"
    rng = random.Random(1234 + seed)
    verified: set[str] = set()
    for kill in range(KILLS_PER_STORE):
        kill_a_writer(store, rng.uniform(0.0, 0.8))
        opened = hsdata.open(str(store))
        ids = set(opened.sample_ids)
        assert verified <= ids, f"kill {kill}: committed samples disappeared"
        for sample_id in (ids - verified) | set(rng.sample(sorted(verified), min(20, len(verified)))):
            i = int(sample_id[1:])
            assert_same(opened.get(sample_id), make_sample(length_of(i), seed=i))  # whole and bit-exact
        verified = ids
        report = validate(str(store))
        assert report.ok, [p.line() for p in report.problems]
    assert len(verified) > 100  # the kills were spread over a long write
    with hsdata.create(str(store), **SPEC, **LAYOUT) as w:  # a new writer continues the same store
        for i in range(max(int(s[1:]) for s in verified) + 1, max(int(s[1:]) for s in verified) + 40):
            w.add(f"s{i}", **make_sample(length_of(i), seed=i))
    final = hsdata.open(str(store))
    assert len(final) == len(verified) + 39
    assert validate(str(store)).ok


@pytest.mark.parametrize("compression", [None, "zstd"])  # zstd: the chunks' writes fail on the compress threads
def test_filesystem_full_gives_a_clear_error_and_a_valid_store(small_filesystem, compression):
    store = small_filesystem / "store"
    written = {}
    with pytest.raises(hsdata.WriterError, match="No space left on device"):
        with hsdata.create(str(store), **SPEC, **LAYOUT, compression=compression) as w:
            for i in range(10_000):
                written[f"s{i}"] = sample = make_sample(length_of(i), seed=i)
                w.add(f"s{i}", **sample)
                if i % 5 == 0:
                    w.flush()
    opened = hsdata.open(str(store))
    assert 0 < len(opened) < len(written)
    for sample_id in opened.sample_ids:
        assert_same(opened.get(sample_id), written[sample_id])
    report = validate(str(store))
    assert report.ok, [p.line() for p in report.problems]
    assert not [k for k in report.leftovers if ".partial" in k]  # the failed writer removed its partial files


def test_a_store_removed_under_its_writer_fails_the_next_commit_and_nothing_comes_back(tmp_path):
    """Local storage makes a key's folders as it writes: without a check a writer whose store was removed would
    commit manifests into a headless copy of the store's folders."""
    store = tmp_path / "store"
    with pytest.raises(hsdata.WriterError, match="the store was removed while part"):
        with hsdata.create(str(store), **SPEC, **LAYOUT) as w:
            w.add("s0", **make_sample(40, seed=0))
            w.flush()
            shutil.rmtree(store)
            w.add("s1", **make_sample(40, seed=1))
            w.flush()
    assert not list(store.rglob("*.parquet"))  # no manifest committed after the removal


def test_a_sample_added_again_after_its_store_was_removed_is_a_fault_not_a_duplicate(tmp_path):
    store = tmp_path / "store"
    w = hsdata.create(str(store), **SPEC, **LAYOUT)
    w.add("s0", **make_sample(40, seed=0))
    w.flush()
    shutil.rmtree(store)
    with pytest.raises(hsdata.WriterError, match="the store was removed while part"):
        w.add("s0", **make_sample(40, seed=0))  # what a client resends into the store made again
    w.abort()
