"""Stores on remote filesystems through fsspec: a real S3-protocol server (moto's server mode) and a plain HTTP
server, both on loopback and started here; faults injected into the HTTP server's responses."""

from __future__ import annotations

import functools
import http.server
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer
from torch.utils.data import DataLoader

import hsdata
from hsdata.io import storage
from conftest import SMALL_LAYOUT, RangeFilesHandler, assert_same, make_sample, range_answer, write_store
from hsdata.errors import CorruptDataError
from hsdata.validate import validate
from hsdata.torch import Eagle3Dataset, ShardAwareSampler, collate_eagle3
from test_cli import hsdata_cli

BUCKET = "hsdata-test"
SAMPLES = {f"s{i:03d}": make_sample(5 + (i * 53) % 300, seed=i) for i in range(40)}


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback and the storage options that reach it."""
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)  # inherited by CLI subprocesses and DataLoader workers
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    # The credentials travel in the options too: a forkserver started earlier in the session (another test
    # module's DataLoader) hands its workers the environment of that moment, without these variables.
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    yield {"options": options, "client": client}
    server.stop()


@pytest.fixture(scope="module")
def s3_store(s3):
    url = f"s3://{BUCKET}/store"
    with hsdata.create(url, storage_options=s3["options"], hidden_size=32, aux_layers=[1, 4, 6],
                       model="test/tiny-llama", **SMALL_LAYOUT) as w:
        for sample_id, sample in SAMPLES.items():
            w.add(sample_id, **sample)
    return url


def test_s3_store_reads_back_bit_exact_and_validates(s3, s3_store):
    store = hsdata.open(s3_store, storage_options=s3["options"])
    assert len(store) == len(SAMPLES)
    for sample_id, sample in SAMPLES.items():
        assert_same(store.get(sample_id), sample)
    report = validate(s3_store, storage_options=s3["options"])
    assert report.ok and report.samples_checked == len(SAMPLES)
    endpoint = f"endpoint_url={s3['options']['endpoint_url']}"
    done = hsdata_cli("validate", s3_store, "--storage-option", endpoint)
    assert done.returncode == 0, done.stdout + done.stderr
    info = hsdata_cli("info", s3_store, "--storage-option", endpoint)
    assert info.returncode == 0 and re.search(r"samples +40 in 1 part", info.stdout), info.stdout + info.stderr


def test_a_corrupt_object_on_s3_raises_and_validate_reports_it(s3, tmp_path):
    url = f"s3://{BUCKET}/corrupt"
    with hsdata.create(url, storage_options=s3["options"], hidden_size=32, aux_layers=[1, 4, 6],
                       model="test/tiny-llama", **SMALL_LAYOUT) as w:
        for sample_id in ("a", "b"):
            w.add(sample_id, **SAMPLES["s001"])
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=BUCKET, Prefix="corrupt/parts/")["Contents"]]
    shard = next(k for k in keys if "/hidden_states/c/" in k)
    body = bytearray(s3["client"].get_object(Bucket=BUCKET, Key=shard)["Body"].read())
    body[100] ^= 0x01  # inside the first sample's payload
    s3["client"].put_object(Bucket=BUCKET, Key=shard, Body=bytes(body))
    store = hsdata.open(url, storage_options=s3["options"])
    with pytest.raises(CorruptDataError, match="'a'"):
        store.get("a")
    assert not validate(url, storage_options=s3["options"]).ok


def test_a_compressed_store_on_s3_reads_back_through_its_indexes_and_validates(s3, tmp_path):
    url = f"s3://{BUCKET}/compressed"
    with hsdata.create(url, storage_options=s3["options"], hidden_size=32, aux_layers=[1, 4, 6],
                       model="test/tiny-llama", compression="zstd", **SMALL_LAYOUT) as w:
        for sample_id, sample in SAMPLES.items():
            w.add(sample_id, **sample)
    store = hsdata.open(url, storage_options=s3["options"], cache_dir=str(tmp_path / "cache"))
    assert store.spec.format_version == 3
    for _ in range(2):  # the second epoch through the local cache
        for sample_id, got in zip(SAMPLES, store.read_many([store.index(i) for i in SAMPLES])):
            assert_same(got, SAMPLES[sample_id])
    report = validate(url, storage_options=s3["options"])
    assert report.ok and report.samples_checked == len(SAMPLES), report.problems


class _RangeHandler(RangeFilesHandler):
    """Static files with HTTP Range support; ``faults`` decides what to do to each file request."""

    faults = {"fail_every": 0, "fail_first": 0, "flip_byte": False, "delay_s": 0.0}
    requests = 0  # file requests answered
    attempts: dict = {}  # (path, range) -> requests for it so far
    active = max_active = 0  # file requests being answered now, and the most at once
    lock = threading.Lock()

    def serve_file(self, path: str, head: bool) -> None:
        with _RangeHandler.lock:
            _RangeHandler.requests += 1
            _RangeHandler.active += 1
            _RangeHandler.max_active = max(_RangeHandler.max_active, _RangeHandler.active)
            self._counted = True
            request = (self.path, self.headers.get("Range"))
            _RangeHandler.attempts[request] = _RangeHandler.attempts.get(request, 0) + 1
            fail = (self.faults["fail_every"] and _RangeHandler.requests % self.faults["fail_every"] == 0
                    or _RangeHandler.attempts[request] <= self.faults["fail_first"])
        time.sleep(self.faults["delay_s"])
        self._answer(path, head, fail)

    def _answer(self, path: str, head: bool, fail: bool) -> None:
        """Send the response; the request stops counting as active before its last bytes go out (after them,
        the client may already send its next request)."""
        try:
            self._respond(path, head, fail)
        finally:
            self._done()

    def _done(self) -> None:
        with _RangeHandler.lock:
            if self._counted:
                _RangeHandler.active -= 1
                self._counted = False

    def _respond(self, path: str, head: bool, fail: bool) -> None:
        if fail or not os.path.isfile(path):
            self._done()
            self.send_error(503, "injected fault") if fail else self.send_error(404)
            return
        status, headers, body = range_answer(path, self.headers.get("Range"))
        if self.faults["flip_byte"] and status == 206 and "/c/" in self.path and body:
            body = bytes([body[0] ^ 0x01]) + body[1:]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self._done()
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 256  # the default 5 drops connections when many requests start at once (1 s SYN retry)
    allow_reuse_address = True


@pytest.fixture
def http_store(tmp_path):
    write_store(tmp_path / "store", SAMPLES)
    handler = lambda *a, **k: _RangeHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _RangeHandler.faults = {"fail_every": 0, "fail_first": 0, "flip_byte": False, "delay_s": 0.0}
    _RangeHandler.requests = _RangeHandler.max_active = 0
    _RangeHandler.attempts = {}
    yield f"http://127.0.0.1:{server.server_address[1]}/store"
    server.shutdown()


class _PlainRangeHandler(RangeFilesHandler):
    """Static files with HTTP Range support and no faults (``_RangeHandler.faults`` does not reach it)."""

    def serve_file(self, path: str, head: bool) -> None:
        if not os.path.isfile(path):
            return self.send_error(404)
        status, headers, body = range_answer(path, self.headers.get("Range"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture(scope="module")
def http_read_only_store(tmp_path_factory):
    """The store of ``SAMPLES`` served over HTTP for the whole module, for tests that only read it (one store
    written and one server started for all of them; DataLoader workers reach it over loopback)."""
    root = tmp_path_factory.mktemp("http")
    write_store(root / "store", SAMPLES)
    server = _Server(("127.0.0.1", 0), functools.partial(_PlainRangeHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/store"
    server.shutdown()
    server.server_close()


_EPOCHS = [("s3", None, False)] + [(protocol, start_method, used_first) for protocol in ("s3", "http")
                                   for start_method in ("fork", "spawn", "forkserver") for used_first in (False, True)]


@pytest.mark.parametrize("protocol, start_method, used_first", _EPOCHS,
                         ids=[f"{p}-{m or 'no_workers'}{'-used_first' if u else ''}" for p, m, u in _EPOCHS])
def test_dataset_epoch_from_a_remote_store(request, protocol, start_method, used_first):
    """An epoch through a DataLoader (two workers of each start method, or none) returns every sample of the
    remote store once, bit-exact; also when the parent read from the dataset before the workers started (a
    forked child inherits the parent's fsspec filesystem, its event loop and connections, and the read-ahead's
    thread pool, none of which it may use; spawn and forkserver workers get the dataset pickled, as its URL and
    options)."""
    if protocol == "s3":
        url, options = request.getfixturevalue("s3_store"), request.getfixturevalue("s3")["options"]
    else:
        url, options = request.getfixturevalue("http_read_only_store"), None
    if start_method == "forkserver":
        # Modules only, as a training script run as `python train.py` has them (the forkserver imports its
        # __main__): imported once by the server, not by each worker (seconds each); no effect once it runs.
        multiprocessing.get_context("forkserver").set_forkserver_preload(["hsdata.torch", "s3fs"])
    dataset = Eagle3Dataset(url, storage_options=options)
    if used_first:  # a batch, as a DataLoader without workers reads it: on the dataset's read-ahead threads
        for item in dataset.__getitems__([0, 1, 2, 3]):
            assert_same(item, SAMPLES[item["sample_id"]])
    loader = DataLoader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=3), collate_fn=collate_eagle3,
                        num_workers=2 if start_method else 0, multiprocessing_context=start_method,
                        timeout=120 if start_method else 0)  # a worker that hangs fails the test
    seen = []
    for batch in loader:
        for b, sample_id in enumerate(batch["sample_id"]):
            want = SAMPLES[sample_id]
            n = len(want["input_ids"])
            assert_same({name: batch[name][b, :n] for name in want}, want)
            assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
            seen.append(sample_id)
    assert sorted(seen) == sorted(SAMPLES)


def test_http_store_is_readable_and_5xx_responses_are_retried(http_store, monkeypatch):
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    _RangeHandler.faults["fail_first"] = 2  # every request answers 503 twice, then the data
    store = hsdata.open(http_store)
    for sample_id, sample in SAMPLES.items():
        assert_same(store.get(sample_id), sample)
    report = validate(http_store)
    assert report.ok, [p.line() for p in report.problems]


def test_http_errors_that_persist_give_a_clear_error(http_store, monkeypatch):
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.001)
    store = hsdata.open(http_store)
    _RangeHandler.faults["fail_every"] = 1  # the server is down for good
    with pytest.raises(Exception, match="503"):
        store.get("s000")


def test_a_corrupted_http_response_never_becomes_a_sample(http_store):
    store = hsdata.open(http_store)
    _RangeHandler.faults["flip_byte"] = True
    with pytest.raises(CorruptDataError, match="does not match its checksum"):
        store.get("s007")
    _RangeHandler.faults["flip_byte"] = False
    assert_same(store.get("s007"), SAMPLES["s007"])
    assert torch.equal(store.get("s007")["input_ids"], SAMPLES["s007"]["input_ids"])


def test_merge_ranges_joins_close_ranges_of_one_object_up_to_a_size():
    ranges = [("a", 100, 200), ("b", 0, 10), ("a", 0, 100), ("a", 250, 300), ("a", 2000, 2100), ("a", 300, 900)]
    merged = storage.merge_ranges(ranges, max_gap=50, max_bytes=600)
    assert merged == [("a", 0, 300, [2, 0, 3]), ("a", 300, 900, [5]), ("a", 2000, 2100, [4]), ("b", 0, 10, [1])]
    assert storage.merge_ranges(ranges, max_gap=0, max_bytes=10**9)[0] == ("a", 0, 200, [2, 0])


def test_neighbouring_samples_share_requests_and_come_back_exact(http_store):
    store = hsdata.open(http_store)
    first = store.storage_order()[:12]  # neighbours on disk: their ranges touch
    _RangeHandler.requests = 0
    for i in first:
        store.read(int(i))
    one_by_one, _RangeHandler.requests = _RangeHandler.requests, 0
    got = store.read_many(first.tolist())
    assert _RangeHandler.requests < one_by_one / 2
    for i, sample in zip(first, got):
        assert_same(sample, SAMPLES[store.sample_ids[i]])


def test_requests_in_flight_are_bounded_by_concurrency(http_store):
    store = hsdata.open(http_store, concurrency=3, range_bytes=1024)  # small ranges: many requests per sample
    _RangeHandler.faults["delay_s"] = 0.02
    _RangeHandler.max_active = 0
    got = store.read_many(list(range(12)))
    assert 1 < _RangeHandler.max_active <= 3
    for sample in got:
        assert_same(sample, SAMPLES[sample["sample_id"]])


def test_the_local_cache_serves_later_epochs_and_stays_bounded(http_store, tmp_path):
    cache = str(tmp_path / "cache")
    first_epoch = hsdata.open(http_store, cache_dir=cache)
    ids = [first_epoch.read(i)["sample_id"] for i in range(len(first_epoch))]
    second_epoch = hsdata.open(http_store, cache_dir=cache)  # another process, say: it shares the directory
    _RangeHandler.faults["fail_every"] = 1  # the server is gone: only the cache can answer
    for i in reversed(range(len(second_epoch))):
        assert_same(second_epoch.read(i), SAMPLES[ids[i]])
    _RangeHandler.faults["fail_every"] = 0
    small = hsdata.open(http_store, cache_dir=str(tmp_path / "small"), cache_max_bytes=64 << 10)
    for i in range(len(small)):
        assert_same(small.read(i), SAMPLES[ids[i]])
        assert sum(f.stat().st_size for f in (tmp_path / "small").iterdir()) <= 64 << 10


def test_extract_writes_a_store_to_s3(s3, tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "input_ids": list(range(1, 9 + i))}) + "\n"
                                                 for i in range(4)))
    url = f"s3://{BUCKET}/extracted"
    done = subprocess.run([sys.executable, "-m", "hsdata", "extract", "--model", str(tmp_path / "config.json"),
                           "--data", str(tmp_path / "rows.jsonl"), "--out", url, "--aux-layers", "0", "1", "2",
                           "--storage-option", f"endpoint_url={s3['options']['endpoint_url']}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    store = hsdata.open(url, storage_options=s3["options"])
    assert sorted(store.sample_ids) == [f"r{i}" for i in range(4)] and store.spec.hidden_size == 64
    assert validate(url, storage_options=s3["options"]).ok
