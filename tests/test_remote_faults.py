"""Remote stores under network faults, against real servers on loopback started here (no mocks of fsspec, s3fs or
aiohttp): an HTTP range server that answers slowly or is restarted mid-read, a fault-injecting proxy in front of
a moto S3 server (503 SlowDown, multipart uploads included), and S3 endpoints taken from environment variables."""

from __future__ import annotations

import functools
import gc
import http.client
import http.server
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse

import aiohttp
import pytest
from torch.utils.data import DataLoader

import hsdata
from conftest import SMALL_LAYOUT, SPEC, RangeFilesHandler, assert_same, make_sample, range_answer, write_store
from hsdata.io import storage
from hsdata.errors import WriterError
from hsdata.torch import Eagle3Dataset, ShardAwareSampler, collate_eagle3
from hsdata.validate import validate
from test_remote import BUCKET, SAMPLES, s3  # noqa: F401 - s3 is a fixture (moto server on loopback)

S3_SPEC = dict(hidden_size=32, aux_layers=[1, 4, 6], model="test/tiny-llama")


# ---------------------------------------------------------------------------------------------------------------
# An HTTP/1.1 (keep-alive) range server whose file answers can stall, and which can be killed and started again.


class _State:
    """What the HTTP server does to file requests; shared by the servers started on one port."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stop = threading.Event()  # wakes stalled answers at teardown
        self.file_requests = 0
        self.slow_first = 0  # the first try of each of the first N distinct requests (object, range) stalls ...
        self.slow_always = False  # ... or every request does
        self.slow_s = 0.0  # for this long: longer than the client waits
        self.stalled = 0  # file requests that stalled
        self._seen: set[tuple[str, str]] = set()
        self.on_file_request = None  # called with (request number, handler) first; True: the server was killed

    def stall(self, path: str, byte_range: str) -> str | None:
        """Whether and how to stall this request: "headers" (say nothing) or "body" (stop halfway through)."""
        with self.lock:
            self.file_requests += 1
            stall = self.slow_always
            if (path, byte_range) not in self._seen and len(self._seen) < self.slow_first:
                self._seen.add((path, byte_range))
                stall = True
            if not stall:
                return None
            self.stalled += 1
            return "headers" if self.stalled % 2 else "body"


class _Handler(RangeFilesHandler):
    protocol_version = "HTTP/1.1"  # persistent connections, as real object stores and CDNs keep them

    def setup(self) -> None:
        super().setup()
        with self.server.state.lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.state.lock:
            self.server.connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # the client gave up on a stalled answer, or the server was killed under it
            pass

    def serve_file(self, path: str, head: bool) -> None:
        state = self.server.state
        stall = state.stall(self.path, self.headers.get("Range", ""))
        number = state.file_requests
        if state.on_file_request is not None and state.on_file_request(number, self):
            return  # the server was killed under this request: no answer
        if not os.path.isfile(path):
            self.send_error(404)
            return
        status, headers, body = range_answer(path, self.headers.get("Range"))
        if stall == "headers":
            state.stop.wait(state.slow_s)  # nothing at all for a while: the client's read times out
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if head:
            return
        elif stall == "body" and len(body) > 1:
            self.wfile.write(body[: len(body) // 2])  # headers and half the body, then a stall mid-body
            self.wfile.flush()
            state.stop.wait(state.slow_s)
            self.wfile.write(body[len(body) // 2 :])
        else:
            self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    allow_reuse_address = True  # a new server may take the port of a killed one at once
    daemon_threads = True
    request_queue_size = 256  # the default 5 drops connects when many requests start at once (1 s SYN retry)

    def __init__(self, port: int, directory: str, state: _State):
        self.state = state
        self.connections: set[socket.socket] = set()
        super().__init__(("127.0.0.1", port), functools.partial(_Handler, directory=directory))
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def handle_error(self, request, client_address) -> None:
        pass  # writes to connections the client (or a kill) closed

    def kill(self) -> None:
        """Stop like a crashed process: the listening socket closed and every open connection reset."""
        self.shutdown()
        self.server_close()
        with self.state.lock:
            connections = list(self.connections)
        for connection in connections:
            try:
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, not FIN
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def served(tmp_path):
    """A store of SAMPLES served over HTTP; yields (url, state, servers) where ``servers`` lists every server
    started (a restart appends)."""
    write_store(tmp_path / "store", SAMPLES)
    state = _State()
    servers = [_Server(0, str(tmp_path), state)]
    yield f"http://127.0.0.1:{servers[0].port}/store", state, servers
    state.stop.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def _timeouts(sock_read: float, total: float) -> dict:
    """storage_options for fsspec's HTTP filesystem: aiohttp.ClientSession(timeout=...)."""
    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=total, sock_read=sock_read)}}


# ---------------------------------------------------------------------------------------------------------------
# 1. Slow responses.


def test_answers_slower_than_the_client_timeout_are_retried_and_read_back_exact(served, monkeypatch, caplog):
    url, state, _ = served
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    state.slow_s, state.slow_first = 2.0, 13  # listings, metadata, manifests and the first ranges: each first try
    # stalls; the listing of removals/ (absent here) is no error after its stall, the other 12 are retried
    caplog.set_level(logging.WARNING, logger="hsdata.io.storage")
    start = time.monotonic()
    store = hsdata.open(url, storage_options=_timeouts(sock_read=0.5, total=5))
    for sample_id, sample in SAMPLES.items():
        assert_same(store.get(sample_id), sample)
    assert state.stalled == 13
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) >= 12 and all("Timeout" in m for m in retries), retries  # more: a busy machine is slow
    assert time.monotonic() - start < 10


def _read_from_a_server_slow_for_good(url: str, state: _State, monkeypatch, retries: int = storage.RETRIES):
    """The error and seconds of a read from a server that stalls every answer; then the server recovers."""
    store = hsdata.open(url, storage_options=_timeouts(sock_read=0.25, total=5))
    state.slow_s, state.slow_always = 3.0, True
    start = time.monotonic()
    with monkeypatch.context() as patch, pytest.raises(Exception) as raised:
        patch.setattr(storage, "RETRIES", retries)
        store.get("s000")
    elapsed = time.monotonic() - start
    state.slow_always = False  # the server recovers: the same store reads exact data again
    assert_same(store.get("s000"), SAMPLES["s000"])
    assert_same(store.get("s001"), SAMPLES["s001"])
    return raised.value, elapsed


def test_a_server_slow_for_good_gives_a_timeout_error_in_bounded_time(served, monkeypatch):
    url, state, _ = served
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    error, elapsed = _read_from_a_server_slow_for_good(url, state, monkeypatch)
    assert isinstance(error, TimeoutError) or isinstance(error.__cause__, TimeoutError), repr(error)
    # one timeout for the first try and one for each of RETRIES retries, plus small backoffs: about 1.6 s
    assert (storage.RETRIES + 1) * 0.25 <= elapsed < 10, elapsed
    assert state.stalled >= storage.RETRIES + 1


def test_a_timeout_error_says_what_was_being_read(served, monkeypatch):
    url, state, _ = served
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    error, _ = _read_from_a_server_slow_for_good(url, state, monkeypatch, retries=1)
    assert f"{url}/parts/" in str(error) and "Timeout" in str(error), repr(error)


# ---------------------------------------------------------------------------------------------------------------
# 2. The server restarted mid-read.


def _restart_after(state: _State, servers: list[_Server], directory: str, nth: int, down_s: float):
    """Arm the server to crash at its ``nth`` file request from now (connections reset, port closed) and come
    back on the same port ``down_s`` later."""
    first = state.file_requests + nth
    restarted = threading.Event()

    def on_file_request(number: int, handler: _Handler) -> bool:
        if number != first:
            return False
        server = servers[0]
        server.kill()

        def start_again() -> None:
            time.sleep(down_s)
            servers.append(_Server(server.port, directory, state))
            restarted.set()

        threading.Thread(target=start_again, daemon=True).start()
        return True

    state.on_file_request = on_file_request
    return restarted


@pytest.mark.parametrize("how", ["store.get", "dataloader"])
def test_a_server_restarted_mid_read_loses_no_sample(served, tmp_path, monkeypatch, caplog, how):
    url, state, servers = served
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.15)  # 5 retries span 0.15 * 31 s * [0.5, 1.5]: >= 2.3 s
    caplog.set_level(logging.WARNING, logger="hsdata.io.storage")
    seen = []
    if how == "store.get":
        store = hsdata.open(url)
        restarted = _restart_after(state, servers, str(tmp_path), nth=20, down_s=0.6)
        for sample_id, sample in SAMPLES.items():
            assert_same(store.get(sample_id), sample)
            seen.append(sample_id)
    else:
        dataset = Eagle3Dataset(url)
        restarted = _restart_after(state, servers, str(tmp_path), nth=20, down_s=0.6)
        loader = DataLoader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=5),
                            collate_fn=collate_eagle3, num_workers=0)
        for batch in loader:
            for b, sample_id in enumerate(batch["sample_id"]):
                n = len(SAMPLES[sample_id]["input_ids"])
                assert_same({name: batch[name][b, :n] for name in SAMPLES[sample_id]}, SAMPLES[sample_id])
                seen.append(sample_id)
    assert sorted(seen) == sorted(SAMPLES)
    assert restarted.is_set() and len(servers) == 2, "the server was restarted while the samples were read"
    assert state.file_requests > 20
    failures = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert any("Cannot connect" in m for m in failures), failures  # refused while down, and retried


# ---------------------------------------------------------------------------------------------------------------
# 3. S3 writes through a fault-injecting proxy in front of moto.

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "expect", "content-length"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message><RequestId>hsdata-test</RequestId></Error>")


class _ProxyState:
    def __init__(self, upstream: str):
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.lock = threading.Lock()
        self.fail_every = 0  # answer 503 SlowDown to every Nth request ...
        self.fail_multipart_once = False  # ... and to the first try of each multipart-upload request
        self.delay_s = 0.0  # every write (PUT, POST, DELETE) waits this long first: a slow store
        self.requests = 0
        self.log: list[tuple[str, str, bool]] = []  # (method, path?query, failed)
        self._seen: set[tuple[str, str]] = set()

    def should_fail(self, method: str, target: str) -> bool:
        with self.lock:
            self.requests += 1
            fail = bool(self.fail_every) and self.requests % self.fail_every == 0
            query = urllib.parse.urlsplit(target).query
            if self.fail_multipart_once and re.search(r"(^|&)(uploads|uploadId=)", query):
                fail = fail or (method, target) not in self._seen
                self._seen.add((method, target))
            self.log.append((method, target, fail))
            return fail


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self):  # noqa: N802
        self._relay()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET  # noqa: N815

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self) -> None:
        state: _ProxyState = self.server.state
        body = self._body()  # read before answering, also when failing, so the connection stays usable
        if state.delay_s and self.command in ("PUT", "POST", "DELETE"):
            time.sleep(state.delay_s)
        if state.should_fail(self.command, self.path):
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_SLOW_DOWN)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(_SLOW_DOWN)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*state.upstream, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response(response.status, response.reason)
        for k, v in response.getheaders():
            if k.lower() not in _HOP_BY_HOP | {"date", "server"}:
                self.send_header(k, v)
        length = response.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length if length is not None else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class _ProxyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


@pytest.fixture
def proxy(s3):  # noqa: F811
    state = _ProxyState(s3["options"]["endpoint_url"])
    server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
    server.state = state
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield {"options": {"endpoint_url": f"http://127.0.0.1:{server.server_address[1]}"}, "state": state}
    server.shutdown()
    server.server_close()


def _check_store(url: str, options: dict, samples: dict) -> None:
    store = hsdata.open(url, storage_options=options)
    assert store.sample_ids == list(samples)
    for sample_id, sample in samples.items():
        assert_same(store.get(sample_id), sample)
    report = validate(url, storage_options=options)
    assert report.ok and report.samples_checked == len(samples), [p.line() for p in report.problems]


def test_s3_writes_through_503_slowdown_faults_read_back_exact(s3, proxy):  # noqa: F811
    proxy["state"].fail_every = 8  # each costs botocore's backoff, about 0.5 s
    samples = dict(list(SAMPLES.items())[:8])
    url = f"s3://{BUCKET}/faulty"
    with hsdata.create(url, storage_options=proxy["options"], **S3_SPEC, **SMALL_LAYOUT) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    failed = [(m, t) for m, t, f in proxy["state"].log if f]
    assert len(failed) >= 5 and "PUT" in {m for m, _ in failed}, failed
    _check_store(url, s3["options"], samples)  # straight from moto, not through the proxy


def test_s3_multipart_uploads_survive_a_503_on_every_step(s3, proxy):  # noqa: F811
    proxy["state"].fail_multipart_once = True
    # one sample whose aux_hidden_states shard (6 MB) is bigger than s3fs's 5 MiB block: a multipart upload
    samples = {"big": make_sample(30_000, seed=99), "small": SAMPLES["s003"]}
    url = f"s3://{BUCKET}/faulty-multipart"
    options = {**proxy["options"], "default_block_size": 5 << 20}  # s3fs's smallest part size (default 50 MiB)
    with hsdata.create(url, storage_options=options, **S3_SPEC, shard_tokens=32_768, chunk_tokens=256) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    failed = {(m, re.sub(r"=[^&]*", "", urllib.parse.urlsplit(t).query)) for m, t, f in proxy["state"].log if f}
    assert {("POST", "uploads"), ("PUT", "partNumber&uploadId"), ("POST", "uploadId")} <= failed, failed
    _check_store(url, s3["options"], samples)


def _committed_prefix(lengths: list[int], flush_after: int, shard_tokens: int) -> int:
    """How many of the samples (in order) lie wholly in closed shards when the writer is aborted after adding
    them all, with a flush after the first ``flush_after``: what hsdata's commit rule makes visible."""
    position, ends = 0, []
    for k, n in enumerate(lengths):
        position += n
        ends.append(position)
        if k + 1 == flush_after:
            position = -(-position // shard_tokens) * shard_tokens  # flush closes the shard; the next starts anew
            closed_after_flush = position
    closed = max(closed_after_flush, position // shard_tokens * shard_tokens)
    return sum(1 for end in ends if end <= closed)


def _write_and_raise_midway(url: str, options: dict) -> tuple[hsdata.Writer, list[str]]:
    """Add SAMPLES s000-s009 with a flush after the first 5, then raise inside the ``with`` block."""
    added = []
    with pytest.raises(RuntimeError, match="the producer failed"):
        with hsdata.create(url, storage_options=options, **S3_SPEC, **SMALL_LAYOUT) as w:
            for k, (sample_id, sample) in enumerate(list(SAMPLES.items())[:10]):
                w.add(sample_id, **sample)
                added.append(sample_id)
                if k == 4:
                    w.flush()
                    assert w.num_committed == 5
            raise RuntimeError("the producer failed")
    return w, added


def test_an_s3_write_that_raises_midway_commits_only_closed_shards(s3, proxy, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sys, "unraisablehook", lambda _: None)  # see test_an_aborted_s3_writer_leaves_no_...
    proxy["state"].fail_every = 12
    url = f"s3://{BUCKET}/faulty-raised"
    w, added = _write_and_raise_midway(url, proxy["options"])
    gc.collect()
    expected = _committed_prefix([len(SAMPLES[i]["input_ids"]) for i in added], 5, SMALL_LAYOUT["shard_tokens"])
    assert 5 < expected < len(added)  # samples committed at a shard boundary after the flush; the last ones not
    assert w.num_committed == expected
    with pytest.raises(WriterError):
        w.add("late", **SAMPLES["s039"])
    _check_store(url, s3["options"], {sample_id: SAMPLES[sample_id] for sample_id in added[:expected]})
    assert validate(url, storage_options=s3["options"]).leftovers == []  # no partial shard became an object
    assert any(f for _, _, f in proxy["state"].log)


def test_an_aborted_s3_writer_leaves_no_exception_behind(s3, monkeypatch):  # noqa: F811
    unraisable = []  # as text: a record's traceback would keep the writer's frames, and the next file, alive
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(
        f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}"))
    _write_and_raise_midway(f"s3://{BUCKET}/aborted", s3["options"])
    gc.collect()
    assert not unraisable, unraisable


# ---------------------------------------------------------------------------------------------------------------
# 4. S3 endpoint from environment variables, in a CLI process given no --storage-option.


@pytest.fixture(scope="module")
def small_s3_store(s3):  # noqa: F811
    url = f"s3://{BUCKET}/env"
    with hsdata.create(url, storage_options=s3["options"], **SPEC, **SMALL_LAYOUT) as w:
        for i in range(3):
            w.add(f"e{i}", **make_sample(10 + i, seed=i))
    return url


ENDPOINT_VARIABLES = ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL", "FSSPEC_S3"]


@pytest.fixture(scope="module")
def cli_runs(s3, small_s3_store):  # noqa: F811
    """`hsdata info --json` of the store, one process per variable (started together), each given the endpoint
    only through that variable."""
    endpoint = s3["options"]["endpoint_url"]
    unset = ("AWS_ENDPOINT_URL", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "FSSPEC_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(unset)}
    base.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    processes = {}
    for variable in ENDPOINT_VARIABLES:
        value = json.dumps({"endpoint_url": endpoint}) if variable == "FSSPEC_S3" else endpoint
        processes[variable] = subprocess.Popen([sys.executable, "-m", "hsdata", "info", small_s3_store, "--json"],
                                               env={**base, variable: value}, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)
    runs = {}
    for variable, process in processes.items():
        try:
            out, err = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        runs[variable] = (process.returncode, out, err)
    return runs


@pytest.mark.parametrize("variable", ENDPOINT_VARIABLES)
def test_cli_takes_the_s3_endpoint_from_the_environment(cli_runs, variable):
    returncode, out, err = cli_runs[variable]
    assert returncode == 0, out + err
    summary = json.loads(out)
    assert summary["samples"] == 3 and summary["tokens"] == 10 + 11 + 12
