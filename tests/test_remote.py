"""Stores on remote filesystems through fsspec: a real S3-protocol server (moto's server mode) and a plain HTTP
server, both on loopback and started here; faults injected into the HTTP server's responses."""

from __future__ import annotations

import http.server
import os
import re
import threading

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer
from torch.utils.data import DataLoader

import hsdata
from hsdata import storage
from conftest import SMALL_LAYOUT, assert_same, make_sample, write_store
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
    yield {"options": {"endpoint_url": endpoint}, "client": client}
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


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_epoch_from_s3(s3, s3_store, workers):
    dataset = Eagle3Dataset(s3_store, storage_options=s3["options"], max_length=64)
    loader = DataLoader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=3), collate_fn=collate_eagle3,
                        num_workers=workers, multiprocessing_context="spawn" if workers else None)
    seen = []
    for batch in loader:
        for b, sample_id in enumerate(batch["sample_id"]):
            n = min(64, len(SAMPLES[sample_id]["input_ids"]))
            assert_same({"aux_hidden_states": batch["aux_hidden_states"][b, :n]},
                        {"aux_hidden_states": SAMPLES[sample_id]["aux_hidden_states"][:n]})
            seen.append(sample_id)
    assert sorted(seen) == sorted(SAMPLES)


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


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with HTTP Range support; ``faults`` decides what to do to each file request."""

    faults = {"fail_every": 0, "flip_byte": False}
    requests = 0
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self):  # noqa: N802
        self._serve(head=True)

    def do_GET(self):  # noqa: N802
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            return super().do_HEAD() if head else super().do_GET()  # the directory listing fsspec parses
        with _RangeHandler.lock:
            _RangeHandler.requests += 1
            fail = self.faults["fail_every"] and _RangeHandler.requests % self.faults["fail_every"] == 0
        if fail:
            self.send_error(503, "injected fault")
            return
        if not os.path.isfile(path):
            self.send_error(404)
            return
        data = open(path, "rb").read()
        status, body = 200, data
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
            end = int(match.group(2)) + 1 if match.group(2) else len(data)
            status, body = 206, data[start:end]
            if self.faults["flip_byte"] and "/c/" in self.path and body:
                body = bytes([body[0] ^ 0x01]) + body[1:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture
def http_store(tmp_path):
    write_store(tmp_path / "store", SAMPLES)
    handler = lambda *a, **k: _RangeHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _RangeHandler.faults = {"fail_every": 0, "flip_byte": False}
    yield f"http://127.0.0.1:{server.server_address[1]}/store"
    server.shutdown()


def test_http_store_is_readable_and_5xx_responses_are_retried(http_store, monkeypatch):
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    _RangeHandler.faults["fail_every"] = 3  # every third request answers 503
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
